"""PILoRA ("PILoRA: Prototype Guided Incremental LoRA for Federated Class-Incremental Learning"):
incremental low-rank adapters on block 0's q and v, learnable class prototypes as the classifier,
and heterogeneity-aware re-weighting of the clients' prototypes on the server."""

from ..registry import Method

CITATION = """\
@inproceedings{guo2024pilora,
  title = {PILoRA: Prototype Guided Incremental LoRA for Federated Class-Incremental Learning},
  author = {Guo, Haiyang and Zhu, Fei and Liu, Wenzhuo and Zhang, Xu-Yao and Liu, Cheng-Lin},
  booktitle = {Computer Vision -- ECCV 2024},
  year = {2024},
}"""

METHOD = Method("pilora", strategy=".strategy:PILoRAStrategy", learner=".learner:PILoRALearner",
                prompt=".prompt:PILoRAAdapters", records=".records:PRIVATE_RECORDS", statistics=".records:STATISTICS",
                options=".options:PILoRAOptions", citation=CITATION)
