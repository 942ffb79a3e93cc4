"""GGUF weights kept as the file stores them and multiplied by native kernels: the block types' facts
(``formats``: what each type costs in memory, read by the fit estimate), the C kernels' one build path
(``build``, sources in ``csrc/``), their Python face (``kernel``), the modules a model holds them in
(``modules``, ``block_embedding``), a GGUF file's header (``gguf_table``) and the loader that maps the file's
tensors into them (``gguf_keep``).

Qt-free; imports torch, transformers and the gguf package, no other room of the engine (the model room imports
it).
"""
