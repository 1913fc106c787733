//! A minimal engine: connect to the local kvmeshd, publish blocks, find the
//! cached prefix of a request, read blocks in place, copy one out.
//!
//! Run a daemon (`scripts/run-daemon.sh`), then:
//! `cargo run -p kvmesh-client --example basic [SOCKET]`
#![forbid(unsafe_code)]

use kvmesh_client::{Allocation, Client, Key};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = match std::env::args().nth(1) {
        Some(path) => Client::connect(path).await?,
        None => Client::connect_default().await?,
    };
    // A namespace fingerprints model, dtype, layout and TP shape.
    let ns = client.register_namespace("example/llama-tiny/bf16/tp1", 16384, "layers=all;layout=nhd").await?;

    // Chained prefix hashes of a 4-block request (engines compute these).
    let keys: Vec<Key> = (1..=4u128).map(|i| Key(0xfeed_0000_0000_0000_0000_0000_0000_0000 | i)).collect();

    // Publish the first three blocks, written in place into the pool.
    let mut writes = Vec::new();
    for (i, a) in client.allocate(&ns, &keys[..3]).await?.into_iter().enumerate() {
        match a {
            Allocation::Allocated(mut block) => {
                block.fill(i as u8 + 1); // the engine's KV bytes go here
                writes.push(block);
            }
            Allocation::Exists => println!("block {i} already cached"),
            Allocation::InProgress => println!("block {i} being written by someone else"),
        }
    }
    let committed = client.commit(writes).await?;
    println!("committed {} blocks", committed.len());

    // How much of the 4-block prefix is cached?
    let found = client.lookup(&ns, &keys).await?;
    println!("cached prefix: {} of {} blocks", found.prefix_len, keys.len());

    // Pin the cached prefix and read it in place (no copy).
    let pinned = client.pin(&ns, &keys[..found.prefix_len as usize]).await?;
    for b in pinned.iter().flatten() {
        b.verify()?; // optional: re-check header, trailer and checksum
        println!(
            "block {} v{}: first byte {}, {} bytes, lease {:?}",
            b.key(),
            b.version(),
            b[0],
            b.len(),
            b.lease_remaining()
        );
    }
    drop(pinned); // unpins

    // Or copy a block into the engine's own buffer.
    let mut buf = vec![0u8; 16384];
    let hits = client.get_into(&ns, &keys[..1], &mut buf).await?;
    println!("copied: hit={} first byte {}", hits[0], buf[0]);

    client.flush_releases().await; // make the deferred unpins visible in stats
    let s = client.stats().await?;
    println!(
        "daemon: {} blocks valid, {} pins outstanding",
        s.pools.iter().map(|p| p.valid).sum::<u32>(),
        s.pins_outstanding
    );
    Ok(())
}
