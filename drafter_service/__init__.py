"""The drafter: proposers (draft model, n-gram) and, later, its gRPC servicer."""
