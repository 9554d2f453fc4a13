"""The demos that `make demo` and `make demo-agent` run."""
