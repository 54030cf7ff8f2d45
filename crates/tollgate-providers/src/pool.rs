//! A provider's pool of upstream accounts as one [`Transport`]: each attempt
//! goes to the member its grant took from ([`AttemptOptions::member`]), with
//! that member's url, headers, secrets and model (`[providers.X] members`;
//! the throttle chooses the member, `lua/throttle/lib/pool.lua`).

use std::collections::BTreeMap;

use async_trait::async_trait;
use tollgate_core::config::{Config, Provider};
use tollgate_core::job::Job;

use crate::http::HttpTransport;
use crate::{Answer, AttemptError, AttemptOptions, SetupError, Transport};

/// One [`HttpTransport`] per member of a provider's pool, by name.
#[derive(Debug)]
pub struct PoolTransport {
    provider: String,
    members: BTreeMap<String, HttpTransport>,
}

impl PoolTransport {
    /// The transports of `provider`'s pool members ([`Provider::pool`]);
    /// each reads its secret headers now (a missing variable fails at
    /// start, naming it).
    pub fn new(provider: &Provider, config: &Config) -> Result<Self, SetupError> {
        let members = provider
            .pool()
            .iter()
            .map(|m| {
                let http = HttpTransport::new(&provider.name, &m.upstream, config)?;
                Ok((m.name.clone(), http))
            })
            .collect::<Result<_, SetupError>>()?;
        Ok(Self {
            provider: provider.name.clone(),
            members,
        })
    }
}

#[async_trait]
impl Transport for PoolTransport {
    /// Sent to the member granted; a grant of no member the pool lists (a
    /// config changed between the grant and now) is never sent.
    async fn attempt(&self, job: &Job, opts: AttemptOptions<'_>) -> Result<Answer, AttemptError> {
        match opts.member.and_then(|m| self.members.get(m)) {
            Some(member) => member.attempt(job, opts).await,
            None => Err(AttemptError::NotSent {
                message: format!(
                    "provider {}: the grant names no member of its pool ({:?})",
                    self.provider, opts.member
                ),
            }),
        }
    }
}
