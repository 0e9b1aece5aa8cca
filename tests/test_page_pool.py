"""The host-side page allocator: promises, sharing by prefix, LRU eviction."""

from eqx_tx.infer.page_pool import PagePool


def test_promises_sharing_and_least_recently_used_eviction():
    pool = PagePool(num_pages=4, page_size=2)
    assert pool.promise(3) and not pool.promise(2)  # 1 page left to promise
    a = [pool.take() for _ in range(3)]
    pool.register([1, 2, 3, 4, 5], a)  # pages 0, 1 full; the third holds one token
    pool.release(a)
    assert (pool.referenced, pool.cached, pool.available) == (0, 2, 4)
    assert [pool.cached_pages([1, 2, 3, 4, 5], n) for n in (1, 2)] == [1, 2] and pool.cached_pages([1, 3], 1) == 0
    # Same first page only: one page shared, the promise shrinks by one.
    assert pool.promise(2) and pool.share([1, 2, 9, 9], 2) == a[:1] and pool.available == 2
    b = [a[0], pool.take()]
    pool.register([1, 2, 9, 9], b)
    pool.release(b)  # least recently used first: a[1], then a[0] (just shared), then b[1]
    assert pool.cached == 3 and pool.promise(4)
    taken = [pool.take() for _ in range(4)]  # the free page (a[2], unkeyed) first, then evictions
    assert taken == [a[2], a[1], a[0], b[1]]
    assert pool.cached == 0 and pool.share([1, 2, 3, 4], 2) == []  # evicted keys are gone
    pool.release(taken)
    assert pool.referenced == 0 and pool.available == 4


def test_namespaces_never_share_and_forget_drops_every_key():
    pool = PagePool(num_pages=4, page_size=2)
    assert pool.promise(2)
    a = [pool.take(), pool.take()]
    pool.register([1, 2, 3, 4], a, namespace=1)  # e.g. computed with LoRA adapter 1
    assert pool.cached_pages([1, 2, 3, 4], 2, namespace=1) == 2
    assert pool.cached_pages([1, 2, 3, 4], 2) == 0 and pool.cached_pages([1, 2, 3, 4], 2, namespace=2) == 0
    assert pool.promise(2) and pool.share([1, 2, 3, 4], 2, namespace=0) == []
    pool.unpromise(2)
    pool.release(a[1:])  # a[1] cached, a[0] still referenced
    assert (pool.referenced, pool.cached) == (1, 1)
    pool.forget()  # new weights: nothing cached stays valid
    assert (pool.referenced, pool.cached, pool.available) == (1, 0, 3)
    assert pool.cached_pages([1, 2, 3, 4], 2, namespace=1) == 0
    pool.release(a[:1])  # no key any more: free, not cached
    assert (pool.referenced, pool.cached, pool.available) == (0, 0, 4)
