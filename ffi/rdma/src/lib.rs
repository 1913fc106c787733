//! RDMA topology: the devices and ports libibverbs sees (name, link layer,
//! state, GID table size, NUMA node). A machine without RDMA hardware has
//! no devices; that is a normal answer, not an error. (Pinning NICs to GPUs
//! by NUMA distance comes later.)

use std::ffi::CStr;

use rdma_sys as sys;

/// One port of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// Port number (1-based).
    pub num: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: &'static str,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: &'static str,
    /// Entries in the GID table.
    pub gid_count: i32,
}

/// One RDMA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// Kernel name (e.g. `mlx5_0`).
    pub name: String,
    /// NUMA node of its PCI function, when the kernel reports one.
    pub numa_node: Option<i32>,
    /// Its ports.
    pub ports: Vec<Port>,
}

fn state_name(s: u32) -> &'static str {
    match s {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

fn link_layer_name(l: u8) -> &'static str {
    match l {
        1 => "InfiniBand",
        2 => "Ethernet",
        _ => "unspecified",
    }
}

/// Lists the RDMA devices and their ports.
pub fn devices() -> Result<Vec<Device>, String> {
    let mut n: i32 = 0;
    // SAFETY: n is an out-pointer; the list is freed below with
    // ibv_free_device_list and not used afterwards.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        // Without the kernel's RDMA subsystem libibverbs reports ENOSYS:
        // that is a machine with no devices.
        if e.raw_os_error() == Some(38) {
            return Ok(Vec::new());
        }
        return Err(format!("ibv_get_device_list failed: {e}"));
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds n valid device pointers.
        let dev = unsafe { *list.add(i) };
        // SAFETY: ibv_get_device_name returns a NUL-terminated name owned by
        // the device, valid while the list is.
        let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
        let numa_node = std::fs::read_to_string(format!("/sys/class/infiniband/{name}/device/numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .filter(|&n| n >= 0);
        let mut ports = Vec::new();
        // SAFETY: dev comes from the live list.
        let ctx = unsafe { sys::ibv_open_device(dev) };
        if !ctx.is_null() {
            // SAFETY: ibv_device_attr is a plain C struct of integers (and
            // C enums whose zero is a valid value): all-zero is a valid value.
            let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
            // SAFETY: ctx is open; attr is an out-pointer of the right type.
            if unsafe { sys::ibv_query_device(ctx, &mut attr) } == 0 {
                for p in 1..=attr.phys_port_cnt {
                    // SAFETY: as for ibv_device_attr: a plain C struct.
                    let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
                    // SAFETY: ctx is open and p is a valid port number.
                    if unsafe { sys::___ibv_query_port(ctx, p, &mut pa) } == 0 {
                        ports.push(Port {
                            num: p,
                            state: state_name(pa.state),
                            link_layer: link_layer_name(pa.link_layer),
                            gid_count: pa.gid_tbl_len,
                        });
                    }
                }
            }
            // SAFETY: ctx was opened above and is closed once.
            unsafe { sys::ibv_close_device(ctx) };
        }
        out.push(Device { name, numa_node, ports });
    }
    // SAFETY: the list came from ibv_get_device_list and is freed once.
    unsafe { sys::ibv_free_device_list(list) };
    Ok(out)
}

/// A human-readable topology report.
pub fn report() -> String {
    match devices() {
        Err(e) => format!("RDMA: cannot list devices ({e}); UCX will use TCP and shared memory"),
        Ok(d) if d.is_empty() => {
            "RDMA: no devices found; UCX will use TCP (between hosts) and shared memory (on one host)".into()
        }
        Ok(devs) => {
            let mut s = format!("RDMA: {} device(s)\n", devs.len());
            for d in devs {
                let numa = d.numa_node.map_or("unknown".to_string(), |n| n.to_string());
                s.push_str(&format!("  {} (NUMA node {numa})\n", d.name));
                for p in d.ports {
                    s.push_str(&format!("    port {}: {} {} gids={}\n", p.num, p.state, p.link_layer, p.gid_count));
                }
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn listing_devices_does_not_fail_without_hardware() {
        // On a machine without RDMA devices the list is empty; with them,
        // every device has a name.
        let d = super::devices().expect("ibv_get_device_list works even without devices");
        for dev in &d {
            assert!(!dev.name.is_empty());
        }
        assert!(super::report().starts_with("RDMA:"));
    }
}
