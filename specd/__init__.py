"""specd: speculative decoding as gRPC microservices (shared core, no servers in here)."""

__version__ = "0.4.0"
