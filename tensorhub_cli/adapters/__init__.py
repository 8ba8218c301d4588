"""Adapters: TensorHub as the weight-sync backend of the RL stacks users already run.

Protocol. One module per stack, each speaking that stack's own interface:

- ``vllm``: vLLM weight-transfer backend ``"tensorhub"`` (``TensorHubWeightTransferEngine``),
  registered by the ``vllm.general_plugins`` entry point (``register``), so
  ``LLM(..., weight_transfer_config={"backend": "tensorhub"})`` works in every worker.
  It imports vLLM only when used.
- ``verl``: verl checkpoint-engine backend ``"tensorhub"``. Importing the module is what
  registers it (``custom_backend_module``), so it needs verl at import: without verl it
  raises ``ImportError`` saying how to install it.
- ``sglang``: ``load`` for SGLang's ``update_weights_from_tensor(load_format=...)``,
  allowed by ``--custom-weight-loader tensorhub_cli.adapters.sglang.load``; each TP
  rank reads its shard where ``layout.sglang_map`` maps the model.
- ``agree``: one resolution for a TP instance's ranks (rank 0 resolves, the engine's
  own group broadcasts it), which ``vllm`` and ``sglang`` use.
- ``hf``: publish and fetch a ``transformers`` model by its HF names; read sharded
  checkpoint directories (``th publish --from HF_DIR``).
"""
