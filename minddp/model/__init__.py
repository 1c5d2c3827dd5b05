"""The model minddp trains, apart from how it is trained (it stands on torch alone):

    gpt.py          GPT (GPT-2's architecture, tied embeddings) and MLP; the sampling loop
    build.py        the model for a `model=` config group, refused when it would not fit memory
    hf_gpt2.py      GPT-2 in Hugging Face's layout, both ways (model.init_from, minddp export)

Importing this package imports nothing.
"""
