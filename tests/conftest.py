import torch
from hypothesis import settings

torch.set_num_threads(1)  # rank threads share two cores; intra-op threads only contend
settings.register_profile("zen", deadline=None, max_examples=40, derandomize=False, print_blob=True)
settings.load_profile("zen")
