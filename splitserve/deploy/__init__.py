"""Deployment files: the Kubernetes manifests of deploy/kubernetes/ and their renderer
(`splitserve deploy kubernetes`, docs/kubernetes.md)."""
