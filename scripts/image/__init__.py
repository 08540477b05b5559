"""`make image` and `make image-check`: the training image built with Docker, or with buildah on a
machine without a Docker daemon, and run the way the Kubernetes pod runs it."""
