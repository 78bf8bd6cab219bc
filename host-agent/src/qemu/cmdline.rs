//! The parts of a QEMU command line the host agent needs: VM name, virtio-blk
//! devices, drives and their aio backend.

use viotrace_shared::record::Backend;

/// A `-device virtio-blk-*` from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkDevice {
    pub id: Option<String>,
    pub drive: Option<String>,
    pub num_queues: Option<u16>,
    pub queue_size: Option<u16>,
}

/// A `-drive` or `-blockdev` from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drive {
    pub id: String,
    pub backend: Backend,
    pub format: Option<String>,
}

#[derive(Debug, Default, PartialEq)]
pub struct Cmdline {
    pub name: Option<String>,
    pub devices: Vec<BlkDevice>,
    pub drives: Vec<Drive>,
    /// vCPUs (`-smp N` or `-smp cpus=N`): virtio-blk's default number of queues.
    pub smp: Option<u16>,
}

/// Splits a QEMU option string `a=b,c=d` (`,,` escapes a comma). A leading bare
/// value becomes key `""`.
fn opts(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut parts = Vec::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == ',' {
            if it.peek() == Some(&',') {
                it.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    for (i, p) in parts.into_iter().enumerate() {
        match p.split_once('=') {
            Some((k, v)) => out.push((k.to_string(), v.to_string())),
            None if i == 0 => out.push((String::new(), p)),
            None => out.push((p, "on".to_string())),
        }
    }
    out
}

fn get<'a>(o: &'a [(String, String)], k: &str) -> Option<&'a str> {
    o.iter()
        .rev()
        .find(|(kk, _)| kk == k)
        .map(|(_, v)| v.as_str())
}

fn backend_from(aio: Option<&str>) -> Backend {
    match aio {
        None | Some("threads") => Backend::Threads,
        Some("native") => Backend::Native,
        Some("io_uring") => Backend::IoUring,
        Some(_) => Backend::Unknown,
    }
}

/// Extracts the parts of a QEMU command line we need.
pub fn parse_cmdline(args: &[String]) -> Cmdline {
    let mut cl = Cmdline::default();
    let mut anon = 0;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].trim_start_matches('-');
        let is_opt = args[i].starts_with('-');
        let val = args.get(i + 1).map(String::as_str);
        if !is_opt || val.is_none() {
            i += 1;
            continue;
        }
        let val = val.unwrap_or_default();
        match a {
            "smp" => {
                let o = opts(val);
                cl.smp = get(&o, "cpus")
                    .or_else(|| get(&o, ""))
                    .and_then(|v| v.parse().ok());
            }
            "name" => {
                let o = opts(val);
                cl.name = get(&o, "guest").or_else(|| get(&o, "")).map(str::to_string);
            }
            "device" => {
                let o = opts(val);
                let drv = get(&o, "driver").or_else(|| get(&o, "")).unwrap_or("");
                if drv.starts_with("virtio-blk") {
                    cl.devices.push(BlkDevice {
                        id: get(&o, "id").map(str::to_string),
                        drive: get(&o, "drive").map(str::to_string),
                        num_queues: get(&o, "num-queues").and_then(|v| v.parse().ok()),
                        queue_size: get(&o, "queue-size").and_then(|v| v.parse().ok()),
                    });
                }
            }
            "drive" => {
                let o = opts(val);
                let id = get(&o, "id").map(str::to_string).unwrap_or_else(|| {
                    anon += 1;
                    format!("drive{}", anon - 1)
                });
                cl.drives.push(Drive {
                    id,
                    backend: backend_from(get(&o, "aio")),
                    format: get(&o, "format").map(str::to_string),
                });
            }
            "blockdev" => cl.drives.extend(parse_blockdev(val)),
            _ => {}
        }
        i += 2;
    }
    cl
}

/// `-blockdev` in key=value or JSON form. The aio mode lives on the protocol
/// (file) node; the device names the top node, so every node in the tree is
/// listed with the aio of the file node below it.
fn parse_blockdev(val: &str) -> Vec<Drive> {
    if val.trim_start().starts_with('{') {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(val) else {
            return Vec::new();
        };
        fn walk(v: &serde_json::Value) -> Option<String> {
            if let Some(a) = v.get("aio").and_then(|a| a.as_str()) {
                return Some(a.to_string());
            }
            v.get("file").and_then(walk)
        }
        let aio = walk(&v);
        let mut out = Vec::new();
        let mut cur = Some(&v);
        while let Some(n) = cur {
            if let Some(name) = n.get("node-name").and_then(|x| x.as_str()) {
                out.push(Drive {
                    id: name.to_string(),
                    backend: backend_from(aio.as_deref()),
                    format: n.get("driver").and_then(|x| x.as_str()).map(str::to_string),
                });
            }
            cur = n.get("file").filter(|f| f.is_object());
        }
        return out;
    }
    let o = opts(val);
    let aio = get(&o, "aio").or_else(|| get(&o, "file.aio"));
    get(&o, "node-name")
        .map(|n| Drive {
            id: n.to_string(),
            backend: backend_from(aio),
            format: get(&o, "driver").map(str::to_string),
        })
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_lab_cmdline() {
        let cl = parse_cmdline(&s(&[
            "qemu-system-x86_64",
            "-name",
            "viotrace-lab",
            "-smp",
            "cpus=2,sockets=1",
            "-drive",
            "file=/x/d.qcow2,if=none,id=data,format=qcow2,aio=io_uring,cache=writeback",
            "-device",
            "virtio-blk-pci,drive=data,id=vdata,num-queues=2",
            "-device",
            "virtio-serial-pci,id=vser",
        ]));
        assert_eq!(cl.name.as_deref(), Some("viotrace-lab"));
        assert_eq!(cl.smp, Some(2));
        assert_eq!(
            cl.devices,
            vec![BlkDevice {
                id: Some("vdata".into()),
                drive: Some("data".into()),
                num_queues: Some(2),
                queue_size: None,
            }]
        );
        assert_eq!(cl.drives[0].backend, Backend::IoUring);
        assert_eq!(cl.drives[0].format.as_deref(), Some("qcow2"));
    }

    #[test]
    fn parses_name_guest_and_defaults() {
        let cl = parse_cmdline(&s(&[
            "q",
            "-name",
            "guest=vm1,debug-threads=on",
            "-drive",
            "file=a,,b.img,if=none",
            "-blockdev",
            r#"{"driver":"raw","node-name":"top","file":{"driver":"file","filename":"x","aio":"native"}}"#,
            "-blockdev",
            "driver=file,node-name=f2,filename=y,aio=io_uring",
        ]));
        assert_eq!(cl.name.as_deref(), Some("vm1"));
        assert_eq!(cl.drives[0].id, "drive0");
        assert_eq!(cl.drives[0].backend, Backend::Threads);
        assert_eq!(cl.drives[1].id, "top");
        assert_eq!(cl.drives[1].backend, Backend::Native);
        assert_eq!(cl.drives[2].backend, Backend::IoUring);
    }
}
