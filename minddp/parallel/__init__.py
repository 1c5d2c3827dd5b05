"""Processes and parallel layouts, below the engine:

    dist             process-group setup and teardown: rank, device, backend from the environment
    mesh             (dp, tp) layouts as a DeviceMesh
    tensor_parallel  Megatron-style column/row-parallel linears for the GPT
    gradnorm         the global gradient norm and clipping, for every layout of the gradients
"""
