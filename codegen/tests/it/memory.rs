//! The memory plan: temporaries share slots, optimizer updates happen in place, and
//! recomputation lowers the peak of temporaries.
