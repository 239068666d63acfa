import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/model_helpers.py
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
