"""Fed-CPrompt ("Fed-CPrompt: Contrastive Prompt for Rehearsal-Free Federated Continual Learning"):
asynchronous prompt learning with every known task's slice, the C2L loss, FedAvg per task slice."""

from ..registry import Method

# The venue is the one FPPL's references print; Fed-CPrompt's own text prints only its template's
# footer (ICML 2023's proceedings), which the note keeps so a reader can check both
CITATION = """\
@inproceedings{bagwe2023fedcprompt,
  title = {Fed-CPrompt: Contrastive Prompt for Rehearsal-Free Federated Continual Learning},
  author = {Bagwe, Gaurav and Yuan, Xiaoyong and Pan, Miao and Zhang, Lan},
  booktitle = {Federated Learning and Analytics in Practice: Algorithms, Systems, Applications, and Opportunities},
  year = {2023},
  note = {Venue as FPPL's references print it; the paper's own text prints the footer
    Proceedings of the 40th International Conference on Machine Learning, Honolulu, Hawaii, USA. PMLR 202, 2023},
}"""

METHOD = Method("fedcprompt", strategy=".strategy:FedCPromptStrategy", learner=".learner:FedCPromptLearner",
                prompt=".prompt:FedCPromptPrompt", options=".options:FedCPromptOptions",
                citation=CITATION)
