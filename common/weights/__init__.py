"""The weight path's pieces both ends share: the trainer's broadcaster (`trainer/weights/`) and the
engines that load the weights (`engine/weights.py`, `engine/vllm_worker_ext.py`).

- `dist.py`: the weight-sync process group (outside the default one) and a thread runner.
- `delta_codec.py`: delta weight updates: encoding, applying, bit checksums.
- `cuda_ipc.py`: one flat GPU buffer per bucket, shared by CUDA IPC handles as data.

Nothing is imported here: vLLM's engine processes import `dist` with torch alone.
"""
