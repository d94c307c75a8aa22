"""The whole gateway: processes, configuration, deployment, docs and layering."""
