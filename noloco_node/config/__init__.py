"""Settings: the pydantic models of every setting, their layering (file, environment, flags) and the flags."""
