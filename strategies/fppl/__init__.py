"""FPPL (Federated Prototype-Augmented Prompt Learning; the paper: "FPPL: An Efficient and Non-IID Robust
Federated Continual Learning Framework"): fused task prompts, a prototype loss on the clients, a
prototype pool and classifier debiasing on the server."""

from ..registry import Method

# The title is the one the paper prints (the method's long name, Federated Prototype-Augmented Prompt
# Learning, is in its abstract); the text names no venue and no year
CITATION = """\
@misc{he-fppl,
  title = {FPPL: An Efficient and Non-IID Robust Federated Continual Learning Framework},
  author = {He, Yuchen and Shen, Chuyun and Wang, Xiangfeng and Jin, Bo},
  note = {The paper's text names no venue and no year},
}"""

METHOD = Method("fppl", strategy=".strategy:FPPLStrategy", learner=".learner:FPPLLearner", prompt=".prompt:FPPLPrompt",
                records=".records:PRIVATE_RECORDS", statistics=".records:STATISTICS",
                options=".options:FPPLOptions", citation=CITATION)
