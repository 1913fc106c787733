//! Errors of the daemon, each mapped to one gRPC status code.

/// An error answered to a client; the message is the status message.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed (bad size, too many keys, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// A named thing (namespace, pool) does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request contradicts existing state (namespace registered with
    /// another block size, ...).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A limit is reached (no evictable slot, too many pins, ...).
    #[error("{0}")]
    ResourceExhausted(String),
    /// The daemon does not take this work now (it is draining).
    #[error("{0}")]
    Unavailable(String),
    /// A bug or an OS failure.
    #[error("{0}")]
    Internal(String),
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Code;
        let code = match &e {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::Unavailable(_) => Code::Unavailable,
            Error::Internal(_) => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}
