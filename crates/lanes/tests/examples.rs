//! Every example in `examples/` runs here, as `cargo run --example` would run it (each asserts
//! what it prints).
#![allow(dead_code)] // nothing else of an example's module is called

#[path = "../examples/run_lane.rs"]
mod run_lane;

#[path = "../examples/keyed_pool.rs"]
mod keyed_pool;

#[path = "../examples/channel_spill.rs"]
mod channel_spill;

#[path = "../examples/axum_tenants.rs"]
mod axum_tenants;

#[test]
fn run_lane_example() {
    run_lane::main().expect("the run_lane example");
}

#[test]
fn keyed_pool_example() {
    keyed_pool::main().expect("the keyed_pool example");
}

#[test]
fn channel_spill_example() {
    channel_spill::main().expect("the channel_spill example");
}

#[test]
fn axum_tenants_example() {
    axum_tenants::main().expect("the axum_tenants example");
}
