"""Local simulation: a coordinator and N sites (or ddp ranks) as OS processes on loopback."""
