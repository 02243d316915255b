"""Pure linear-algebra kernels on tensors (no models, clients or rounds), each tested against a dense reference."""
