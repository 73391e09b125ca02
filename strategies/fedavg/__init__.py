"""FedAvg-Prompt: CODA-P clients and sample-weighted averaging, the papers' common baseline."""

from promptfcl.strategies.registry import Method

METHOD = Method("fedavg", strategy=".strategy:FedAvgStrategy", learner=".learner:FedAvgLearner")
