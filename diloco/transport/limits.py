"""Sizes both ends of the transport agree on."""

# Messages carry chunks of at most 1 MiB plus a small header; 4 MiB is gRPC's default too.
MAX_MESSAGE_BYTES = 4 << 20
