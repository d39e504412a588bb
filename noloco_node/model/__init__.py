"""The replica's model: the Llama-style decoder, export to safetensors, consensus export, eval and generate."""
