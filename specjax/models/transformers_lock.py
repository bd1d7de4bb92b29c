"""One lock for every use of transformers in specjax (loading and building tokenizers).

transformers' lazy module is not thread-safe on first use: a name asked for while another thread
is importing it can be missing ("module 'transformers' has no attribute 'AutoTokenizer'"). Training
loads its data's tokenizer in a thread while the models and their tokenizers load in the main
thread, so both may touch transformers for the first time together.
"""

import threading

TRANSFORMERS = threading.RLock()
