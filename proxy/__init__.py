"""specgate: the load-aware gateway between a speculative and a baseline SGLang server."""
