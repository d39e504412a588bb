"""What a node says about itself: status document, telemetry, Prometheus metrics, the HTTP server, logs."""
