"""Fed-CPrompt ("Fed-CPrompt: Contrastive Prompt for Rehearsal-Free Federated Continual Learning"):
asynchronous prompt learning with every known task's slice, the C2L loss, FedAvg per task slice."""

from promptfcl.strategies.registry import Method

METHOD = Method("fedcprompt", strategy=".strategy:FedCPromptStrategy", learner=".learner:FedCPromptLearner")
