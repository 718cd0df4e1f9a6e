//! Prints a loopback port nothing listens on, for a server a script is about to start:
//! [`idem_testkit::harness::free_port`], the ports the tests start their servers on.
//!
//! Usage: `free-port [--cluster]`; with `--cluster`, the port 10000 above (a Redis Cluster
//! node's bus port) is free too.

use std::process::ExitCode;

use idem_testkit::harness;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let port = match args.as_slice() {
        [] => harness::free_port(),
        [flag] if flag == "--cluster" => harness::free_port_and(10_000),
        _ => {
            eprintln!("usage: free-port [--cluster]");
            return ExitCode::from(2);
        }
    };
    println!("{port}");
    ExitCode::SUCCESS
}
