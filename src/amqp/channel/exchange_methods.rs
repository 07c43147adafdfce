//! `exchange.*`: declare (with an `alternate-exchange` argument), delete,
//! and exchange-to-exchange bind and unbind.

use amq_protocol::protocol::{exchange, AMQPClass};
use amq_protocol::types::{FieldTable, ShortString};

use crate::amqp::channel::queue_methods::inequivalent_flags;
use crate::amqp::channel::Channel;
use crate::amqp::reply::{hard, node_soft, soft, Hard, Soft, COMMAND_INVALID, PRECONDITION_FAILED};
use crate::error::NodeError;
use crate::message::to_args;
use crate::metadata::names;
use crate::metadata::routing::ArgValue;
use crate::metadata::{Access, Binding, ExchangeKind, ExchangeMeta};

impl Channel {
    pub(in crate::amqp) async fn exchange_method(
        &mut self,
        m: exchange::AMQPMethod,
    ) -> Result<bool, Result<Soft, Hard>> {
        use exchange::AMQPMethod as E;
        match m {
            E::Declare(d) => {
                let bare = d.exchange.as_str();
                if let Err(why) = names::check("exchange", bare) {
                    return Err(Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 40, 10)));
                }
                let name = self.key(bare);
                if d.passive {
                    if self.node.metadata().exchange(&name).is_none() && {
                        self.node.meta_barrier().await;
                        self.node.metadata().exchange(&name).is_none()
                    } {
                        return Err(self.not_found("exchange", bare, 40, 10));
                    }
                } else {
                    self.may(Access::Configure, "exchange", bare, 40, 10)?;
                    let Some(kind) = ExchangeKind::parse(d.kind.as_str()) else {
                        return Err(Err(hard(
                            COMMAND_INVALID,
                            format!("COMMAND_INVALID - unknown exchange type '{}'", d.kind.as_str()),
                        )));
                    };
                    let alternate = match to_args(&d.arguments).get("alternate-exchange") {
                        None => None,
                        Some(ArgValue::Str(alt)) => {
                            // As RabbitMQ: unroutable messages are written there.
                            self.may(Access::Write, "exchange", alt, 40, 10)?;
                            self.may(Access::Read, "exchange", bare, 40, 10)?;
                            Some(self.key(alt))
                        }
                        Some(_) => {
                            let why = "PRECONDITION_FAILED - invalid arg 'alternate-exchange': not a string";
                            return Err(Ok(soft(PRECONDITION_FAILED, why.to_string(), 40, 10)));
                        }
                    };
                    if let Some(current) = self.node.metadata().exchange(&name) {
                        let flags = [
                            ("durable", d.durable, current.durable),
                            ("auto_delete", d.auto_delete, current.auto_delete),
                            ("internal", d.internal, current.internal),
                        ];
                        inequivalent_flags(&flags, "exchange", bare, &self.vhost, 40, 10)?;
                    }
                    let ex = ExchangeMeta {
                        name,
                        kind,
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        alternate,
                        args: to_args(&d.arguments),
                    };
                    self.node.declare_exchange(ex).await.map_err(|e| Ok(node_soft(e, 40, 10)))?;
                }
                if !d.nowait {
                    self.reply(AMQPClass::Exchange(E::DeclareOk(exchange::DeclareOk {}))).await;
                }
                Ok(true)
            }
            E::Delete(d) => {
                self.may(Access::Configure, "exchange", d.exchange.as_str(), 40, 20)?;
                // An exchange that is not there is deleted already, as in
                // RabbitMQ: delete-ok, not a 404.
                match self.node.delete_exchange(&self.key(d.exchange.as_str()), d.if_unused).await {
                    Ok(()) | Err(NodeError::NotFound(_)) => {}
                    Err(e) => return Err(Ok(node_soft(e, 40, 20))),
                }
                if !d.nowait {
                    self.reply(AMQPClass::Exchange(E::DeleteOk(exchange::DeleteOk {}))).await;
                }
                Ok(true)
            }
            E::Bind(b) => {
                let binding = self.binding_of(&b.source, &b.destination, true, &b.routing_key, &b.arguments);
                self.change_binding(binding, true, (40, 30)).await?;
                if !b.nowait {
                    self.reply(AMQPClass::Exchange(E::BindOk(exchange::BindOk {}))).await;
                }
                Ok(true)
            }
            E::Unbind(b) => {
                let binding = self.binding_of(&b.source, &b.destination, true, &b.routing_key, &b.arguments);
                self.change_binding(binding, false, (40, 40)).await?;
                if !b.nowait {
                    self.reply(AMQPClass::Exchange(E::UnbindOk(exchange::UnbindOk {}))).await;
                }
                Ok(true)
            }
            other => Err(Err(hard(COMMAND_INVALID, format!("exchange.{other:?} is not a client method")))),
        }
    }

    /// Make (`add`) or remove a binding a client asked for with method
    /// `(class, method)`: as RabbitMQ, write permission on the destination
    /// and read on the source first.
    pub(in crate::amqp) async fn change_binding(
        &mut self,
        binding: Binding,
        add: bool,
        (class, method): (u16, u16),
    ) -> Result<(), Result<Soft, Hard>> {
        let kind = if binding.to_exchange { "exchange" } else { "queue" };
        self.may(Access::Write, kind, names::name_of(&binding.destination), class, method)?;
        self.may(Access::Read, "exchange", names::name_of(&binding.exchange), class, method)?;
        let done = if add { self.node.bind(binding).await } else { self.node.unbind(binding).await };
        done.map_err(|e| Ok(node_soft(e, class, method)))
    }

    pub(in crate::amqp) fn binding_of(
        &self,
        exchange: &ShortString,
        destination: &ShortString,
        to_exchange: bool,
        key: &ShortString,
        args: &FieldTable,
    ) -> Binding {
        Binding {
            exchange: self.key(exchange.as_str()),
            destination: self.key(destination.as_str()),
            to_exchange,
            routing_key: key.as_str().to_string(),
            args: to_args(args),
        }
    }
}
