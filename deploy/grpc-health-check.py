#!/usr/bin/env python3
"""Ask a specsplit worker's gRPC health service (grpc.health.v1.Health) for its status.

Usage:
    grpc-health-check.py HOST:PORT [SERVICE] [--timeout SECONDS]

SERVICE is "specsplit.DraftService", "specsplit.TargetService" or "" (the server as a whole,
the default). Prints the status and exits 0 for SERVING, 1 for any other status, 2 when the
worker cannot be reached or does not know the service.

Needs: pip install grpcio grpcio-health-checking (e.g. in a virtualenv). Kubernetes does not need
this script: its probes speak the health protocol natively (see deploy/k8s).
"""
import argparse
import sys

try:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
except ImportError:
    sys.exit("grpc-health-check: needs the Python packages grpcio and grpcio-health-checking")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("address", help="HOST:PORT of the worker, e.g. 127.0.0.1:50051")
    ap.add_argument("service", nargs="?", default="",
                    help='health service name (default "": the whole server)')
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = ap.parse_args()

    address = args.address
    for scheme in ("http://", "grpc://"):
        if address.startswith(scheme):
            address = address[len(scheme):]
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service),
                               timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address} {args.service or '(server)'}: {e.code().name}: {e.details()}")
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
