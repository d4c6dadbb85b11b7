"""gazctl, the operator command line."""

import os

# gRPC's C core writes failed TLS handshakes to stderr at INFO: gazctl says why a broker cannot
# be reached itself, in one line.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
