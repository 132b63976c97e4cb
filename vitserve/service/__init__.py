"""vitserve's HTTP service and command line: thin over the `encoder` library."""
