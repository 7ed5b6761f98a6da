"""Message stores: one interface (:mod:`relay.store.interface`), several backends."""
