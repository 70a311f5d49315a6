//! Training runs through the CPU runtime.
