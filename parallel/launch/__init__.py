"""Starting processes: a strategy's child (as a user would, never waited on forever), the zygote that forks
it in milliseconds, and N spawned gloo ranks in one call for tests and the oracle."""
