"""Load generation and the SGLang simulator used to test and demonstrate specgate."""
