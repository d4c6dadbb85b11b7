"""Same-run baselines: bare grpc.aio chains of separate processes on loopback, no protocol."""
