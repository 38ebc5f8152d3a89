import os
import sys
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU in tests
sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")
