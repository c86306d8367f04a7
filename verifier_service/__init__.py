"""The verifier: continuous-batching engine with speculative verification, gRPC servicer."""
