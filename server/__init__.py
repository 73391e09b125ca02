"""promptfcl's server side: the ServerApp, the task loop, checkpoints, reports, the simulation
launcher, benchmarks and the command line."""
