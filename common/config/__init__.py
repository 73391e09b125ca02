"""Run configuration: the experiment's sections, their checks, files and options."""
