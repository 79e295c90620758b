"""The full ``HiCacheController``: SGLang's HiCache controller with the fork's CP shared KV,
per-layer write-back, draft pools and the L3 storage tier.

In the order data flows through it:

- ``cache_controller.HiCacheController``: ``write`` -> ``start_writing`` -> ``ack_write_queue``
  -> ``evict_device`` -> ``load`` -> ``start_loading`` (``layer_done_counter``) ->
  ``ack_load_queue`` -> ``evict_host`` -> ``reset``; ``base``: the state the parts share;
  ``operations``: transfer ops and acks; ``inflight``: which slots a queued copy still uses;
- ``cp_write``: CP reservations (``reserve_write_cp``) and their all-layer or per-layer
  submission (``submit_write_cp_per_layer``, ``on_layer_end``, ``cancel_layer_write_state``);
  ``rollback``: a failed submission undone; ``cp_load``: ``load_cp`` with owner replay;
- ``side_pool``: an independent side pool (``attach_side_pool``, ``write_with_side``,
  ``load_with_side``, ``evict_side_host``; ``SidePools``, what the tree names);
- ``storage`` (a package): the L3 tier the controller owns; ``storage_facade``: the seed's
  storage method and queue names on the controller, delegating to it.
"""
