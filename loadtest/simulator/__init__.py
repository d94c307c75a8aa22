"""A simulated SGLang server: SGLang's wire contract, with speed that follows a measured profile."""
