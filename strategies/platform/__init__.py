"""The platform every method builds on (one method = one folder beside this one, its strategy a
``PromptStrategy`` subclass that fills hooks): Flower's contract, sampling, reply checks,
weighting and averaging, and each round's bookkeeping."""
