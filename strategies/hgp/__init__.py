"""HGP ("Reducing Bias in Federated Class-Incremental Learning with Hierarchical Generative
Prototypes"): per-class Gaussian prototypes from the clients, hierarchical sampling and classifier
rebalancing on the server."""

from promptfcl.strategies.registry import Method

METHOD = Method("hgp", strategy=".strategy:HGPStrategy", learner=".learner:HGPLearner")
