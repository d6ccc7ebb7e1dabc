"""The oracle and the diagnoses: each strategy's training against single's, the honest noise its tolerance allows,
the injected bugs that prove it, the shallow twin, and hangs named by rank and collective."""
