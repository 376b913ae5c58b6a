"""A run's credentials: site ids, per-site tokens, and the TLS certificates of a run CA.
Imports neither grpc nor torch: the transport applies them, ``diloco-certs`` writes them."""
