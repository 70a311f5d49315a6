//! Integration tests of the pass pipeline, in one binary (each melior-linked test binary is
//! ~245 MB).

mod pipeline;
