import aetcd


async def test_etcd_put_get_under_prefix(etcd: aetcd.Client, etcd_prefix: str) -> None:
    await etcd.put(f"{etcd_prefix}/k".encode(), b"v")
    got = await etcd.get(f"{etcd_prefix}/k".encode())
    assert got is not None and got.value == b"v"
