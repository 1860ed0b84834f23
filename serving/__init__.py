"""Serving: a host-side scheduler driving a static-shape device engine, over gRPC and HTTP."""
