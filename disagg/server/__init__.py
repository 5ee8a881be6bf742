"""The front door: an OpenAI-compatible HTTP server in front of a cluster's decoders."""
